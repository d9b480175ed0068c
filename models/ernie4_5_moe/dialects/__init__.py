"""How other frameworks name and describe ERNIE 4.5 MoE checkpoints (`models.dialect`)."""
