"""The Kafka edge: how every producer, consumer and admin client ALMA Stream makes
connects (``kafka``: TLS, SASL), and what the broker says of logs, times, groups and
their committed offsets (``broker_view``: ``alma offsets reset``, ``alma
lag-exporter``)."""
