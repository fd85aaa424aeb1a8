"""In-process tests: real components (the model, the scheduler, servers) inside the test process."""
