"""Parse command lines the way a script of ours would, without running it (tests/clusters/test_doc_commands.py).

    python tests/jobs/doc_args_job.py SCRIPT '[["--flag", "value"], ...]'

prints one JSON line per command line: ``{"argv": [...], "error": null}`` when the script accepts
it, else the script's error message. A script with a ``parse_args(argv)`` function is imported and
that function called, so its own checks after argparse's count; any other runs as ``__main__`` and
is stopped as soon as its argparse parser has parsed (nothing after that runs: no benchmark, no job).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import io
import json
import runpy
import sys
from pathlib import Path
from types import ModuleType


class Parsed(BaseException):
    """The script's parser accepted the command line; raised to stop the script right there."""


def stop_after_parsing() -> None:
    """Make every argparse parser stop the program once it has parsed without an error."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, args: object = None, namespace: object = None) -> None:
        original(self, args, namespace)
        raise Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[assignment]


def load(script: Path) -> ModuleType | None:
    """The script as a module when it has ``parse_args(argv)``, else None (it must run as __main__)."""
    spec = importlib.util.spec_from_file_location(f"doc_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parse = getattr(module, "parse_args", None)
    return module if parse is not None and inspect.signature(parse).parameters else None


def error_of(script: Path, module: ModuleType | None, argv: list[str]) -> str | None:
    """What the script says about ``argv``: None when it accepts it."""
    said = io.StringIO()
    sys.argv = [str(script), *argv]
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            if module is not None:
                module.parse_args(argv)
                return None
            runpy.run_path(str(script), run_name="__main__")
    except Parsed:
        return None
    except SystemExit as exc:
        return said.getvalue().strip().splitlines()[-1] if said.getvalue().strip() else f"exit status {exc.code}"
    except Exception as exc:  # noqa: BLE001 - whatever the script raised is the answer
        return f"{type(exc).__name__}: {exc}"
    return "ran to its end without parsing a command line with argparse"


def main() -> int:
    """Check every command line given for one script."""
    script, cases = Path(sys.argv[1]).resolve(), json.loads(sys.argv[2])
    sys.path.insert(0, str(script.parent))
    module = load(script)
    if module is None:
        stop_after_parsing()
    for argv in cases:
        print(json.dumps({"argv": argv, "error": error_of(script, module, argv)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
