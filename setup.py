"""One build step beyond pyproject.toml: the web demo and the JavaScript client it loads go into the wheel.

Their sources stay where they are developed (web_demo/, clients/js/, the latter an npm package with its
own tests); the build copies the files the page needs to `gateway/static/` in the wheel, in the same
layout, so `gateway.http.static` serves a non-editable install the same way it serves a checkout. An editable
install copies nothing: it serves the checkout's folders.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# (source folder, glob): the page's files, and the JavaScript client's modules (not its tests or package.json)
WEB_FILES = (("web_demo", "*.*"), ("clients/js", "*.js"))


class BuildPyWithWebDemo(build_py):
    def _web_files(self):
        for folder, pattern in WEB_FILES:
            for source in sorted((ROOT / folder).glob(pattern)):
                if source.is_file():
                    yield source, Path(self.build_lib, "gateway", "static", folder, source.name)

    def run(self):
        super().run()
        if self.editable_mode:
            return
        for source, target in self._web_files():
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        return outputs + [str(target) for _, target in self._web_files()]


setup(cmdclass={"build_py": BuildPyWithWebDemo})
