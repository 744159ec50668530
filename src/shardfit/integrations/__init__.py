"""shardfit inside the trainers people already use: a Hugging Face Trainer callback
(`integrations.transformers.ShardfitCallback`), a Lightning callback (`integrations.lightning`), a
custom Accelerate loop (`integrations.accelerate`), and Plans read from an existing setup
(`integrations.setup_plan`, behind `plan/fit --from-trainer-args / --from-accelerate-config / --deepspeed`).

On top of everything: nothing else in shardfit imports this package."""
