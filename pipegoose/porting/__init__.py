"""The porting toolkit: vendor upstream kernels from pinned sources (``kernels.yaml``) into ``vendor/`` and
``LICENSES/``, record hashes in ``kernels.lock``, verify them, and audit/update against newer upstreams.

``tools/port.py`` is the command line over this package. Imports: the manifest, filelock, gitpython,
packaging, pyyaml (no torch).
"""

from .audit import AuditReport, audit, update
from .errors import FetchError, IntegrityError, LicenseError, ManifestFactError, PortError, SourceFileMissing
from .fetch import Fetcher, pip_index_config
from .lock import Lock
from .porter import STATES, KernelState, Porter, Problem

__all__ = [
    "Porter", "Problem", "KernelState", "STATES", "Lock", "Fetcher", "pip_index_config", "audit", "update",
    "AuditReport", "PortError", "FetchError", "IntegrityError", "LicenseError", "ManifestFactError",
    "SourceFileMissing",
]
