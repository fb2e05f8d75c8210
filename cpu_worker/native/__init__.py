"""The native unit: the C sources, their header, and the one module that builds and loads them."""
