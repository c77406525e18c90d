"""Run settings: the schema (one dataclass tree every module reads), loading YAML with
`--set` overrides and validation, and the command-line flags built from the schema."""
