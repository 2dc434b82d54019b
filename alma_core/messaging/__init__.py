"""The Kafka edge: how every producer, consumer and admin client ALMA Stream makes
connects (TLS, SASL), in one place."""
