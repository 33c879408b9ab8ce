"""NRI (Node Resource Interface): the runtime side, the plugin SDK and podgate's plugins."""
