"""The one compiled piece: runner.data.storage._jpegregion, a small libjpeg-turbo binding
that decodes only a crop's region (loader.decoder=region). Optional: without libjpeg's
headers (Debian: libjpeg62-turbo-dev) the install still succeeds, and region decoding
is reported unavailable with that install step."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("runner.data.storage._jpegregion",
                             ["runner/data/storage/jpegregion.c"], libraries=["jpeg"],
                             extra_compile_args=["-O2"], optional=True)])
