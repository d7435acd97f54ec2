"""The Inference Instance role: the Engine interface real engines implement,
and a reference engine on a small real transformer."""
