"""How other frameworks name and describe GLM-4.5 checkpoints: one `<format>.rules` (the
framework's names -> HF names) and/or `<format>.py` (its matcher) per framework, found through
the registry (`Family.dialect(name)`, `models.dialect`)."""
