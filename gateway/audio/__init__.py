"""Audio formats, knowing nothing else of the gateway: PCM, G.711 and resampling (pcm.py), the
compressed-file encoders (encoders.py), and reference clips for cloning: read (reference.py), decoded in
child processes (decoder.py), fetched from a URL (fetch.py)."""
