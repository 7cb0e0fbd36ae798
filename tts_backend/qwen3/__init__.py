"""Qwen3-TTS 12 Hz in plain PyTorch: talker, code predictor, codec, prompt, sampling, loader.

Entry points:
  Qwen3TTS.from_pretrained(path, device, dtype)   a checkpoint folder -> model (+ codec, tokenizer, configs)
  Qwen3TTS.generate_codes(prompts, params, gens)  the reference's batched loop
  Qwen3TTS.start_utterance(...) -> Utterance      streaming text in, frames out
  Qwen3TTS.codec_stream() -> CodecStream          frames in, waveform out, state carried
  Qwen3TTS.clone_prompt(audio, ref_text, x_vector_only) -> VoicePrompt   Base checkpoints: a cloned voice
"""

from .config import ConfigError, GenerationConfig, Qwen3TTSConfig
from .generate import CodecStream, Qwen3TTS, TextFeed, Utterance
from .loader import CheckpointError
from .prompt import Prompt, PromptError, VoicePrompt, build_clone_prompt, build_prompt
from .sampling import SamplingParams

__all__ = [
    "CheckpointError", "CodecStream", "ConfigError", "GenerationConfig", "Prompt", "PromptError", "Qwen3TTS",
    "Qwen3TTSConfig", "SamplingParams", "TextFeed", "Utterance", "VoicePrompt", "build_clone_prompt", "build_prompt",
]
