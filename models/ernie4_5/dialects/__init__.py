"""How other frameworks name and describe ERNIE 4.5 dense checkpoints (`models.dialect`)."""
