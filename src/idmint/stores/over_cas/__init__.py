"""What idmint builds over any compare-and-set store (`CasStore`, stores/base.py), for every
engine: loop.py (the read-swap loop and its back-off), ranges.py (segment keys), quorum.py
(quorum nodes). An engine that has cells gets these for nothing."""
