"""Errors raised by the porting toolkit. Every message says what failed and, where it can, what to run."""

from __future__ import annotations

__all__ = ["PortError", "FetchError", "IntegrityError", "LicenseError", "SourceFileMissing", "ManifestFactError"]


class PortError(RuntimeError):
    """Base class: a port operation failed; vendor/, LICENSES/ and kernels.lock were left as they were."""


class FetchError(PortError):
    """The source could not be downloaded or read (network, index, git remote, archive format)."""


class IntegrityError(PortError):
    """A hash does not match (archive sha256, git commit, a file recorded in kernels.lock)."""


class LicenseError(PortError):
    """A source's license file is missing, or its text does not carry the declared (allowed) license."""


class SourceFileMissing(PortError):
    """A file named in kernels.yaml does not exist in the source at its pin."""


class ManifestFactError(PortError):
    """kernels.yaml disagrees with the source (e.g. a header included by a kernel is not in its ``files``)."""
