"""pdgate: a Rust-accelerated gateway for prefill/decode disaggregated vLLM fleets."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pdgate")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
