import warnings

__version__ = "0.1.0"

# cryptography ≥ 48 warns, at import, about every DSA name asyncssh's crypto layer
# mentions; asyncssh still supports DSA keys, and studiotui never offers them. Left on,
# the warning lands on every command's stderr (and in front of `serve`'s address line).
warnings.filterwarnings("ignore", message=r"DSA is deprecated", module=r"asyncssh(\.|$)")
