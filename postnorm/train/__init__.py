"""Training: the state, the objective, the steps, their programs, validation and the loop."""
