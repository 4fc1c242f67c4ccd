"""What the step holds: live-storage tracking of real and fake tensors, the peak of partitioned graphs and of
Inductor's schedules (with each op's registered memory contract), the optimizer phase, simulated ranks."""
