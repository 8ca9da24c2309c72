"""The comparison dashboard (Streamlit + Plotly) over the run store: `stratpack dashboard`."""
