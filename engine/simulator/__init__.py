"""The discrete-event simulator (`executor=sim`) and its wall-clock paced variant."""
