"""Measuring transfers through a real rate-limited, delayed kernel link (veth + tbf + a TUN delay relay
in network namespaces), and fitting the simulator's TCP link model to them (engine/pricing/tcp_link.py;
docs/links.md)."""
