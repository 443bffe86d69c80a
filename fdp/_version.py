"""fdp's version, and the oldest torch it runs on."""

import re

__version__ = "0.1.0.dev0"

# The oldest torch release whose whole test suite fdp passes (checked on 2.11 to 2.15). Older
# releases lack torch internals fdp reads on every call (the saved-tensor hooks a replica
# carries, torch 2.8+) or compile differently (dynamo's graph-break controls and guards).
OLDEST_TORCH = (2, 11)


def check_torch(version: str) -> None:
    """Raises ``ImportError`` for a torch older than :data:`OLDEST_TORCH`, which would fail
    later inside a call with an ``AttributeError`` about torch's internals."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and (int(found[1]), int(found[2])) < OLDEST_TORCH:
        oldest = ".".join(map(str, OLDEST_TORCH))
        raise ImportError(
            f"fdp needs torch {oldest} or newer, but torch {version} is installed: upgrade it with "
            f"pip install 'torch>={oldest}' (for the CPU-only build, add --index-url "
            "https://download.pytorch.org/whl/cpu)"
        )
