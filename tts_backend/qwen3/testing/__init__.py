"""Random-weight checkpoints in the official layout (tests and benchmarks): checkpoint.py writes the model folder,
codec_checkpoint.py its speech_tokenizer/."""
