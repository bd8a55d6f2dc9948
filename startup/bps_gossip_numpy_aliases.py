"""Start-up hook installed with bps-gossip: MXNet 1.9.1 imports under numpy >= 1.24.

MXNet 1.9.1 uses numpy's aliases ``np.bool``, ``np.int``, ``np.float``, ``np.complex``,
``np.object`` and ``np.str``, which numpy 1.24 removed, and numpy < 1.24 has no wheels for
Python 3.12 and later. ``bps_gossip_numpy_aliases.pth`` (beside this file in site-packages)
imports this module when Python starts; it only adds a finder that waits for the first
``import mxnet`` anywhere (the user's script, mxnet_plugin, a library), and right before
it puts back those aliases numpy lacks, with the builtins they stood for. Nothing else is
touched; with numpy < 1.24 (Python 3.8-3.11) nothing is done at all, and a process that
never imports mxnet pays one name comparison per import.
"""

import sys

ALIASES = {"bool": bool, "int": int, "float": float, "complex": complex, "object": object, "str": str}


def restore_numpy_aliases() -> list:
    """Put back numpy's removed aliases if numpy is 1.24 or newer; returns the names set."""
    import numpy

    major, minor = (int(part) for part in numpy.__version__.split(".")[:2])
    if (major, minor) < (1, 24):
        return []
    added = [name for name in ALIASES if name not in vars(numpy)]
    for name in added:
        setattr(numpy, name, ALIASES[name])
    return added


class BeforeMXNet:
    """A meta-path finder that finds nothing: on the first import of ``mxnet`` it restores
    numpy's aliases and removes itself."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):  # noqa: ARG003 - the finder protocol
        if name == "mxnet":
            if cls in sys.meta_path:
                sys.meta_path.remove(cls)
            restore_numpy_aliases()
        return None


def install() -> None:
    """Add the finder (once), unless mxnet is already imported."""
    if "mxnet" not in sys.modules and BeforeMXNet not in sys.meta_path:
        sys.meta_path.insert(0, BeforeMXNet)


install()
