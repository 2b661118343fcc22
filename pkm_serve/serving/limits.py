"""Limits shared by the flag parser and the request decoders (kept apart so that
decoding tensors does not depend on the command-line module)."""

DEFAULT_MAX_REQUEST_BYTES = 64 << 20
