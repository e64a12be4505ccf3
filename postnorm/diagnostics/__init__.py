"""Pure in-step statistics of the residual stream: forward statistics and backward taps."""
