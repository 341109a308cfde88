"""Data preparation, in the order a record flows through it: read records (`records`, `formats`, `sharding`), render
them with the chat template (`render`, `chat_template`), turn character spans into token loss spans (`spans`), write
`.pbin` shards (`pbin`) and merge them into the dataset index (`index`, read back by `reader`). `stage` holds the
Prefect tasks."""
