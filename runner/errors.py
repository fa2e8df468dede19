"""The one exception that means "skip", not "fail"."""


class Unavailable(RuntimeError):
    """This machine cannot run this combination (no CUDA, a missing library, a dtype the
    device lacks). The run is recorded as ``status=skipped`` with this message as the
    reason, and exits 0 so a sweep goes on. The message names what is missing."""
