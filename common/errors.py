"""Errors a user can cause. The CLI prints ``str(err)`` on one line and exits 2."""


class GpubenchError(Exception):
    """Base of every user-facing error."""


class UnknownSKUError(GpubenchError):
    pass


class SKUMismatchError(GpubenchError):
    pass


class NoDeviceError(GpubenchError):
    pass


class ResultsFormatError(GpubenchError):
    pass


class ConfigError(GpubenchError):
    pass


class TraceFormatError(GpubenchError):
    pass


class UnknownModelError(GpubenchError):
    pass


def suggest(name: str, choices) -> str:
    """' (did you mean: a, b?)' for close matches of name among choices, else ''."""
    import difflib

    close = difflib.get_close_matches(name.lower(), [c.lower() for c in choices], n=3, cutoff=0.5)
    if not close:
        close = [c for c in choices if name.lower() in c.lower()][:3]
    return f" (did you mean: {', '.join(close)}?)" if close else ""


class KVCommError(GpubenchError):
    """A KV-cache operation the toolkit cannot do exactly (unsupported rope type, mismatched caches...)."""


class DeviceMemoryError(GpubenchError):
    """Too little free device memory for a probe's buffers (the message names bytes needed and free)."""
