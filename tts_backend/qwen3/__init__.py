"""Qwen3-TTS 12 Hz in plain PyTorch: talker, code predictor, codec, prompt, sampling, loader."""
