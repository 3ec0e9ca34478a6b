"""The trainer's session with the shards: join, heartbeat, rejoin, leave, the model's flat slots, a layout switch, the data cursor's claims, ranks from torchrun."""
