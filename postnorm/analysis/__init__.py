"""What a run shows: its records read back, collapse detection, summaries, figures, the report,
Monte Carlo of the model against the theory, and Theorem 3.8 on a checkpoint."""
