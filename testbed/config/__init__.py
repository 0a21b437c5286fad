"""From `key=value` to a typed run: config groups from the registries and Hydra composition
(composer), override parsing shared by every command (overrides), URI-password redaction (redact),
and `RunSpec`, the one typed description handed below the commands (spec)."""
