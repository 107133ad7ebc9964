"""Training (section 5): the optimizer and its schedule, the label-smoothed loss, and the
loop, with its checkpoints, resume and guards."""
