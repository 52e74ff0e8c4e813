"""deja viewer: the DuckDB index over cassettes and the Streamlit app."""

__all__: list[str] = []
