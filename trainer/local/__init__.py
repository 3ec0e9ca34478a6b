"""Ps-cluster and ps-plot: shards and trainers as local processes, their schedules and summaries."""
