"""LiveKit Agents TTS plugin for Voxgate: `from voxgate_livekit import TTS`."""

from livekit.agents import Plugin

from .tts import TTS, ChunkedStream, SynthesizeStream
from .version import __version__

__all__ = ["TTS", "ChunkedStream", "SynthesizeStream", "__version__"]


class VoxgatePlugin(Plugin):
    def __init__(self) -> None:
        super().__init__(__name__, __version__, __package__)


Plugin.register_plugin(VoxgatePlugin())
