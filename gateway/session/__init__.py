"""One WebSocket connection's session: the connection loop (connection.py), the speech pipeline that
synthesizes and sends its sentences (pipeline.py), resume from the store (resume.py), the data they share
(data.py), every write to the socket (writer.py), sentence splitting (segmenter.py) and word times
(word_times.py). The connection loop holds the pipeline, the resumer and the writer; they know nothing of it."""
