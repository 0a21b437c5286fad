"""What the driver and the stage processes both compute, the same way in each: KV pool sizing, device placement, span timers; imports neither side."""
