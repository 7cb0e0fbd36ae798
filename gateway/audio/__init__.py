"""Audio formats, knowing nothing else of the gateway: PCM, G.711 and resampling (pcm.py), the
compressed-file encoders (encoders.py), and decoding of uploaded reference clips (reference.py)."""
