"""One exception hierarchy. Every message names the bad value and says how to fix it."""


class DraftwiseError(Exception):
    """Base class of every error draftwise raises on purpose."""


class ConfigError(DraftwiseError, ValueError):
    """A sampling or speculation setting is out of range."""


class ModelNotFoundError(DraftwiseError, FileNotFoundError):
    """A model name, path or hub id could not be resolved to weights."""


class ModelLoadError(DraftwiseError):
    """Weights were found but could not be loaded (unsupported architecture, bad checksum)."""


class IncompatibleDrafterError(DraftwiseError):
    """The drafter cannot serve this target (for example, different vocabularies)."""


class PromptError(DraftwiseError, ValueError):
    """The prompt is empty or does not fit in the model's context."""
