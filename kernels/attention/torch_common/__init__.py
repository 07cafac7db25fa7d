"""What the two torch backends share: host-built metadata that groups a step's sequences, query rows
laid out per KV head, and the backend class over a paged attention function."""
