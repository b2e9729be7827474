{application, fedgate_uplink_batcher, [
    {description, "fedgate: a gateway's device readings packed into batches before the WAN hop"},
    {vsn, "1.0.0"},
    {modules, [fedgate_uplink_batcher_app, fedgate_uplink_batcher]},
    {registered, [fedgate_uplink_batcher_sup, fedgate_uplink_batcher]},
    {applications, [kernel, stdlib, rabbit_common, rabbit, amqp_client]},
    {mod, {fedgate_uplink_batcher_app, []}},
    %% the queue and exchange are the gateway's definitions' (gateways/wiring.py);
    %% pass_through: routing keys forwarded alone, each in order with the batches
    %% (a device's command acknowledgements, which the backend routes by key);
    %% buckets: a region's batches per flush; with 1, one router at a time bridges
    %% the region (src/fedgate_uplink_batcher.erl says when to raise it)
    {env, [
        {queue, <<"fedgate.uplink.batch-in">>},
        {exchange, <<"fedgate.uplink.batches">>},
        {linger_ms, 25},
        {max_readings, 500},
        {max_bytes, 262144},
        {buckets, 1},
        {prefetch, 2000},
        {pass_through, [<<"devices.*.acks">>]}
    ]}
]}.
