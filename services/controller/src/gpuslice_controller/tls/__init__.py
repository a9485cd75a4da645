"""The webhook's TLS: certificates and the CA (``certs``), the leader's rotation of the Secret
and the webhook configurations' CA bundles (``rotation``), and the certificate the server
presents, reloaded from the Secret (``serving``)."""
