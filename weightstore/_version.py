"""The version string, in a leaf module so the layers that stamp files with it import no package."""

__version__ = "0.1.0"
