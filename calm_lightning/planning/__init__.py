"""What a sweep will launch and what it will cost (`calm-lightning plan`): sweep.py expands a
sweep into jobs, jobs.py reads what each job does from its composed config, passes.py counts
its passes per method, cost_model.py turns them into seconds and bytes on a device, pricing.py
prices the sweep (base model once, other budgets, SLURM limits), output.py prints it. Nothing
here imports torch."""
