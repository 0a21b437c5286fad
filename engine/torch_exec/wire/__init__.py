"""The wire between the driver and the stages, used by both processes: typed authenticated messages, the socketpair lane, block-table deltas, address checks; imports neither side."""
