"""Pipecat TTS service for Voxgate: `from voxgate_pipecat import VoxgateTTSService`."""

from .tts import VoxgateTTSService, VoxgateTTSSettings, language_to_voxgate_language

__all__ = ["VoxgateTTSService", "VoxgateTTSSettings", "language_to_voxgate_language"]
