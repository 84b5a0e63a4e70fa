"""`python -m environments.kv_lookup` writes train.jsonl and eval.jsonl beside this file."""

from environments.kv_lookup import write_task_files

write_task_files()
