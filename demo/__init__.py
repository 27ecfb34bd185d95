"""The demo training job: a small GPT trained with FSDP2, checkpointed, resumed resharded."""
