%% fedgate's uplink batcher: a gateway's device readings packed into batches
%% before the WAN hop.
%%
%% Why: what a reading costs the federation is mostly what it wakes on its way
%% (the backend's federation link, a shard queue, a router, a Kafka request),
%% not work.  Packing the readings of `linger_ms` into one message wakes each of
%% those once per batch (docs/benchmarks.md, "Batching before the WAN hop").
%%
%% The batcher reads the gateway's queue `queue` (bound to the MQTT exchange
%% with "#"; single active consumer, so one node's batcher reads it at a time,
%% in order) over a direct connection, and publishes to `exchange`, which the
%% backend's uplink link federates.  A reading is acked on the queue only once
%% the batch that carries it is confirmed: nothing acked is lost, and what was
%% in flight when the batcher or its node died is delivered again (duplicates
%% are deduplicated downstream by message id).
%%
%% A device's readings stay in order: each device hashes to one of `buckets`
%% batches, each bucket has its own routing key, and the backend's
%% consistent-hash exchange sends a routing key to one shard.  One bucket (the
%% default) sends a region's readings as one message per flush, read by one
%% router at a time (routers share regions, not a region): every batch costs
%% each hop after it a wake-up whatever its size, and 4 buckets at 3,000
%% readings/s cost the engines 1.04 cores against 0.64 for one (single
%% profile; the HA profile's replicated queues pay per message three times;
%% docs/benchmarks.md).  More buckets spread one region over several routers,
%% for a region whose readings outgrow one router (~36,000/s measured).  Routing keys
%% matching `pass_through` travel alone, in order with the batches (the backend
%% routes a device's command acknowledgements by their key).  A message that
%% already crossed a federation link (a command on its way down) is not
%% carried back: federation's max-hops did that before.
%%
%% The format is backend/uplink_batch.py's.
-module(fedgate_uplink_batcher).
-behaviour(gen_server).

-include_lib("amqp_client/include/amqp_client.hrl").

-export([start_link/0, stats/0]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2, terminate/2]).

-define(BATCH_CONTENT_TYPE, <<"application/vnd.fedgate.uplink-batch.v1">>).
-define(RECEIVED_FROM, <<"x-received-from">>).
-define(BATCH_KEY_PREFIX, "fedgate-batch").
%% backend/contract.py's FIRST_READING_AT_HEADER: when the batch's first reading reached the
%% batcher (ms since the epoch), for the routers' gateway-to-Kafka latency histogram
-define(FIRST_READING_AT, <<"x-fedgate-first-reading-at">>).
-define(RECONNECT_MS, 1000).

-record(bucket, {entries = [] :: iolist(), n = 0 :: non_neg_integer(), bytes = 0 :: non_neg_integer(),
                 first_ms = 0 :: non_neg_integer()}).
-record(st, {
    cfg :: map(),
    conn :: pid() | undefined,
    ch :: pid() | undefined,
    %% bucket number => #bucket{}, readings not yet published
    buckets = #{} :: map(),
    buffered = 0 :: non_neg_integer(),
    buffered_bytes = 0 :: non_neg_integer(),
    timer :: reference() | undefined,
    %% the highest delivery tag received, and the highest a flush covered (its ack sent, or
    %% waiting in `pending` for its batch's confirm): a tag covered twice would be acked twice,
    %% and RabbitMQ closes a channel that acks an unknown tag
    last_tag = 0 :: non_neg_integer(),
    covered_tag = 0 :: non_neg_integer(),
    %% publishes not yet confirmed (sequence numbers), and in publish order the delivery
    %% tag each flush covers: {last sequence number of the flush, delivery tag}
    unconfirmed = gb_sets:empty(),
    pending = queue:new(),
    next_seq = 1 :: pos_integer(),
    batches = 0 :: non_neg_integer(),
    readings = 0 :: non_neg_integer(),
    alone = 0 :: non_neg_integer(),
    skipped = 0 :: non_neg_integer(),
    %% channels lost and opened again (the first connect at boot not counted)
    reconnects = 0 :: non_neg_integer()
}).

start_link() ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, [], []).

%% Counters since the batcher (re)started: batches, readings in them, messages sent alone,
%% messages not carried back, channels lost.
stats() ->
    gen_server:call(?MODULE, stats).

init([]) ->
    Env = maps:from_list(application:get_all_env(fedgate_uplink_batcher)),
    Cfg = Env#{pass_through := [binary:split(P, <<".">>, [global]) || P <- maps:get(pass_through, Env)]},
    self() ! connect,
    {ok, #st{cfg = Cfg}}.

handle_call(stats, _From, S) ->
    {reply, #{batches => S#st.batches, readings => S#st.readings, alone => S#st.alone,
              skipped => S#st.skipped, reconnects => S#st.reconnects,
              connected => S#st.ch =/= undefined}, S}.

handle_cast(_Msg, S) ->
    {noreply, S}.

handle_info(connect, S) ->
    {noreply, connect(S)};
handle_info(#'basic.consume_ok'{}, S) ->
    {noreply, S};
handle_info({#'basic.deliver'{delivery_tag = Tag, routing_key = Key}, #amqp_msg{props = Props, payload = Body}},
            S = #st{ch = Ch}) when Ch =/= undefined ->
    {noreply, delivered(Tag, Key, Props, Body, S)};
handle_info(flush, S) ->
    {noreply, flush(S#st{timer = undefined})};
handle_info(#'basic.ack'{delivery_tag = Seq, multiple = Multiple}, S = #st{unconfirmed = U}) ->
    Confirmed = case Multiple of
                    true -> gb_sets:filter(fun(X) -> X > Seq end, U);
                    false -> gb_sets:del_element(Seq, U)
                end,
    {noreply, ack_confirmed(S#st{unconfirmed = Confirmed})};
handle_info(#'basic.nack'{}, S) ->
    %% the node could not take a batch: start again from the queue, which delivers again
    %% everything not acked
    {stop, {shutdown, batch_nacked}, S};
handle_info({'DOWN', _Ref, process, Pid, Reason}, S = #st{conn = Pid}) ->
    rabbit_log:warning("fedgate uplink batcher: connection closed (~tp); reconnecting", [Reason]),
    {noreply, lost(reconnect_later(S))};
handle_info({'DOWN', _Ref, process, Pid, Reason}, S = #st{ch = Pid}) ->
    rabbit_log:warning("fedgate uplink batcher: channel closed (~tp); reconnecting", [Reason]),
    {noreply, lost(reconnect_later(close(S)))};
handle_info(#'basic.cancel'{}, S) ->
    rabbit_log:warning("fedgate uplink batcher: consumer cancelled (its queue deleted?); reconnecting"),
    {noreply, lost(reconnect_later(close(S)))};
handle_info(_Other, S) ->
    {noreply, S}.

terminate(_Reason, S) ->
    _ = close(S),
    ok.

%% --- connection ------------------------------------------------------------------------

connect(S = #st{cfg = Cfg = #{queue := Q}}) ->
    case amqp_connection:start(#amqp_params_direct{}) of
        {ok, Conn} ->
            erlang:monitor(process, Conn),
            try consume(Conn, Cfg) of
                Ch ->
                    rabbit_log:info("fedgate uplink batcher: reading ~ts", [Q]),
                    S#st{conn = Conn, ch = Ch, cfg = Cfg#{cluster_name => rabbit_nodes:cluster_name()}}
            catch
                _:Why ->
                    %% the queue is not there yet: the definitions come after the node's boot
                    rabbit_log:debug("fedgate uplink batcher: not reading ~ts yet: ~tp", [Q, Why]),
                    reconnect_later(close(S#st{conn = Conn}))
            end;
        {error, Why} ->
            %% the virtual host is not up yet
            rabbit_log:debug("fedgate uplink batcher: no connection yet: ~tp", [Why]),
            reconnect_later(S)
    end.

consume(Conn, #{queue := Q, prefetch := Prefetch}) ->
    {ok, Ch} = amqp_connection:open_channel(Conn),
    %% a channel error (the batches' exchange deleted) closes the channel, not the connection
    erlang:monitor(process, Ch),
    #'confirm.select_ok'{} = amqp_channel:call(Ch, #'confirm.select'{}),
    ok = amqp_channel:register_confirm_handler(Ch, self()),
    #'basic.qos_ok'{} = amqp_channel:call(Ch, #'basic.qos'{prefetch_count = Prefetch}),
    #'basic.consume_ok'{} = amqp_channel:subscribe(Ch, #'basic.consume'{queue = Q}, self()),
    Ch.

close(S = #st{conn = Conn}) ->
    _ = case Conn of
            undefined -> ok;
            _ -> catch amqp_connection:close(Conn)
        end,
    S#st{conn = undefined, ch = undefined}.

%% Everything not acked is delivered again on the next channel: forget it.
reconnect_later(S = #st{timer = T}) ->
    _ = case T of undefined -> ok; _ -> erlang:cancel_timer(T) end,
    erlang:send_after(?RECONNECT_MS, self(), connect),
    S#st{conn = undefined, ch = undefined, buckets = #{}, buffered = 0, buffered_bytes = 0,
         timer = undefined, last_tag = 0, covered_tag = 0, unconfirmed = gb_sets:empty(),
         pending = queue:new(), next_seq = 1}.

lost(S) ->
    S#st{reconnects = S#st.reconnects + 1}.

%% --- readings in ------------------------------------------------------------------------

delivered(Tag, Key, Props = #'P_basic'{headers = Headers}, Body, S = #st{cfg = Cfg}) ->
    case is_list(Headers) andalso lists:keymember(?RECEIVED_FROM, 1, Headers) of
        true ->
            %% acked with the next flush
            arm(S#st{last_tag = Tag, skipped = S#st.skipped + 1});
        false ->
            case pass_through(Key, maps:get(pass_through, Cfg)) of
                true ->
                    %% the batches so far first (they cover the tags before this one)
                    S1 = flush(S),
                    send_alone(Key, Props, Body, S1#st{last_tag = Tag});
                false ->
                    arm(add(Key, Props, Body, S#st{last_tag = Tag}))
            end
    end.

add(Key, Props, Body, S = #st{cfg = Cfg, buckets = Bs}) ->
    PropsBin = rabbit_framing_amqp_0_9_1:encode_properties(Props),
    Entry = [<<(byte_size(Key)):16>>, Key, <<(byte_size(PropsBin)):32>>, PropsBin,
             <<(byte_size(Body)):32>>, Body],
    Size = 10 + byte_size(Key) + byte_size(PropsBin) + byte_size(Body),
    N = bucket_of(Key, maps:get(buckets, Cfg)),
    B = case maps:get(N, Bs, #bucket{}) of
            Empty = #bucket{n = 0} -> Empty#bucket{first_ms = erlang:system_time(millisecond)};
            Filling -> Filling
        end,
    B1 = B#bucket{entries = [Entry | B#bucket.entries], n = B#bucket.n + 1, bytes = B#bucket.bytes + Size},
    S1 = S#st{buckets = Bs#{N => B1}, buffered = S#st.buffered + 1},
    case B1#bucket.n >= maps:get(max_readings, Cfg) orelse B1#bucket.bytes >= maps:get(max_bytes, Cfg) of
        true -> flush(S1);
        false -> S1
    end.

%% The linger timer, started by the first message of a flush.
arm(S = #st{timer = undefined, last_tag = Last, covered_tag = Covered, cfg = #{linger_ms := L}})
  when Last > Covered ->
    S#st{timer = erlang:send_after(L, self(), flush)};
arm(S) ->
    S.

%% A device's readings always share a bucket: its id is the key's second word.
bucket_of(Key, Buckets) ->
    Device = case binary:split(Key, <<".">>, [global]) of
                 [_, Id | _] -> Id;
                 _ -> Key
             end,
    erlang:phash2(Device, Buckets).

pass_through(Key, Patterns) ->
    Words = binary:split(Key, <<".">>, [global]),
    lists:any(fun(P) -> matches(Words, P) end, Patterns).

matches([], []) -> true;
matches([_ | Ws], [<<"*">> | Ps]) -> matches(Ws, Ps);
matches([W | Ws], [W | Ps]) -> matches(Ws, Ps);
matches(_, _) -> false.

%% --- batches out ------------------------------------------------------------------------

flush(S = #st{timer = T}) ->
    _ = case T of undefined -> ok; _ -> erlang:cancel_timer(T) end,
    S1 = maps:fold(fun publish_bucket/3, S#st{timer = undefined}, S#st.buckets),
    cover(S1#st{buckets = #{}, buffered = 0}).

publish_bucket(_N, #bucket{n = 0}, S) ->
    S;
publish_bucket(N, #bucket{entries = Entries, n = Count, first_ms = First},
               S = #st{cfg = #{exchange := X, cluster_name := C}}) ->
    %% backend/contract.py's UPLINK_BATCH_KEY_PREFIX, the region, the bucket
    Key = <<?BATCH_KEY_PREFIX, ".", C/binary, ".", (integer_to_binary(N))/binary>>,
    Props = #'P_basic'{delivery_mode = 2, content_type = ?BATCH_CONTENT_TYPE,
                       headers = [{?FIRST_READING_AT, long, First}]},
    S1 = publish(X, Key, Props, lists:reverse(Entries), S),
    S1#st{batches = S1#st.batches + 1, readings = S1#st.readings + Count}.

send_alone(Key, Props, Body, S = #st{cfg = #{exchange := X}}) ->
    S1 = publish(X, Key, Props, Body, S),
    cover(S1#st{alone = S1#st.alone + 1}).

publish(X, Key, Props, Payload, S = #st{ch = Ch, next_seq = Seq, unconfirmed = U}) ->
    ok = amqp_channel:cast(Ch, #'basic.publish'{exchange = X, routing_key = Key},
                           #amqp_msg{props = Props, payload = iolist_to_binary(Payload)}),
    S#st{next_seq = Seq + 1, unconfirmed = gb_sets:add_element(Seq, U)}.

%% Every delivery up to last_tag is now in a publish (or not carried back): its ack
%% waits for the confirms of every publish so far.  A flush with nothing delivered since
%% the last one (a message passed through right after a batch) covers nothing again.
cover(S = #st{last_tag = Last, covered_tag = Covered}) when Last =< Covered ->
    S;
cover(S = #st{last_tag = Last, next_seq = Next, pending = P}) ->
    ack_confirmed(S#st{pending = queue:in({Next - 1, Last}, P), covered_tag = Last}).

ack_confirmed(S = #st{pending = P, unconfirmed = U, ch = Ch}) ->
    Lowest = case gb_sets:is_empty(U) of
                 true -> infinity;
                 false -> gb_sets:smallest(U)
             end,
    case queue:peek(P) of
        {value, {Seq, Tag}} when Seq < Lowest ->
            ok = amqp_channel:cast(Ch, #'basic.ack'{delivery_tag = Tag, multiple = true}),
            ack_confirmed(S#st{pending = queue:drop(P)});
        _ ->
            S
    end.
