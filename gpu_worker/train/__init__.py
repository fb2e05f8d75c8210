"""Draft-head training pipeline (DESIGN.md section 7): target features over a corpus,
head training, and the tau evaluation of section 10. Entry point: ``dovetail-train``."""
