"""Build script: everything declarative lives in pyproject.toml; this file only adds the start-up hook.

The hook is a ``.pth`` file placed at the top of site-packages. Python's :mod:`site` executes its ``import``
line at every interpreter start-up, which installs ``lightning_bagua._registration``'s import hook; that hook
registers the package's strategies when Lightning's strategy registry is imported, so that
``Trainer(strategy="bagua")`` works in a script that never imports ``lightning_bagua``.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "lightning_bagua_registration.pth"
# One line, because `site` only executes lines that start with `import`; the call is explicit so the hook does not
# depend on what `lightning_bagua/__init__.py` happens to do, and it is idempotent.
PTH_CONTENT = "import lightning_bagua._registration; lightning_bagua._registration.install_registration_hook()\n"


class BuildPyWithStartupHook(build_py):
    """Build the packages as usual, then add the ``.pth`` file to the root of the build output.

    Anything at the root of a pure-Python wheel is installed at the top of site-packages, which is the only
    place ``site`` looks for ``.pth`` files.
    """

    def run(self) -> None:
        """Build the packages and write the ``.pth`` file next to them."""
        super().run()
        self._write_pth(Path(self.build_lib))
        if self.editable_mode:
            # An editable wheel is assembled from its own unpacked directory, which setuptools hands to the
            # `install` command as `install_lib`; `build_lib` is a scratch folder that never reaches the wheel.
            install_lib = getattr(self.distribution.get_command_obj("install"), "install_lib", None)
            if install_lib:
                self._write_pth(Path(install_lib))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        """List the built files, the ``.pth`` file included."""
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib, PTH_NAME))]

    def _write_pth(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / PTH_NAME
        self.announce(f"writing {path}", level=2)
        if not self.dry_run:
            path.write_text(PTH_CONTENT, encoding="utf-8")


setup(cmdclass={"build_py": BuildPyWithStartupHook})
